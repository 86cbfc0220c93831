"""The chaos harness: `pdserve chaos` runs fault scenarios against a live cluster.

See docs/reliability.md for the scenarios and what each checks.
"""
