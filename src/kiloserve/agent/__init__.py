"""``kiloserve agent``: registers one engine in etcd while it is healthy (SPEC S3.3, S3.4)."""
