"""Which blocks to remove: the criteria registry and the similarity pass that feeds it.

- `criteria`: streamline, shortgpt, angular, manual and none, registered by name; the similarity pass.
"""
