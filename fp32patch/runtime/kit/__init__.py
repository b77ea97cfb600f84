"""Layer 3's shared part: what every RL stack's glue is built from (the contract is below)."""
