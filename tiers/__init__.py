"""Storage tiers: one file per medium behind one small batched interface."""
