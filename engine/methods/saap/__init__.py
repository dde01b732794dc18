"""Saap (asymmetric indexing): the policy (policy.py) and the partitions it learns once per model (partitions.py:
buckets of keys and a query classifier)."""
