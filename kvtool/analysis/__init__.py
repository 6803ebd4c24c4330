"""Looking at caches and measuring formats: statistics, metrics, fidelity, sweeps and every figure."""
