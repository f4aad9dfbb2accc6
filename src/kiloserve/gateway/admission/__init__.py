"""Admission: who may send what, how fast, and when it reaches a backend (docs/admission.md).

One idea, six modules; each is imported on its own (this file imports none of them):

* ``auth``: API keys (``AuthConfig``, ``KeyStore``): 401 unknown key, 403 model not allowed;
* ``ratelimit``: per-key token buckets, in-process (``LocalLimiter``) or in Redis
  (``RedisLimiter``): 429 + ``Retry-After``;
* ``queue``: the ``admission`` config (``AdmissionConfig``, ``InputLimits``) and the pure
  per-pool queue ``PoolQueue`` (lanes, priorities, ageing, tenant fair share,
  memory-budget windows; time passed in);
* ``capacity``: pure per-backend capacity (memory need, KV budget, in-flight caps);
* ``controller``: the live ``AdmissionController``: one queue per model pool,
  reservations per backend, release on completion and on a ticker, queue metrics;
* ``gate``: the per-request gate the app installs (``FlowControl``,
  ``install_flow_control``, ``check_input_limits``): key, input limits, rate limit,
  admission queue, then the app's decide + forward.
"""
