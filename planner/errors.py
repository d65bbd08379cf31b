class PlanError(Exception):
    """A plan that cannot be made or used (budget too small, stale or mismatched .gpuidx); printed as one line."""
