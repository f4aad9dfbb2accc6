"""Backend registries: the static YAML list (default) or etcd (``registry.kind: etcd``)."""
