"""Upstream dlinfer/framework/__init__.py (v0.2.7): a copyright line only."""
