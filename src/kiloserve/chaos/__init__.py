"""``kiloserve chaos``: fault-injection drills on a local twin cluster (SPEC S3.6)."""
