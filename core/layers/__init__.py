"""cadence package."""
