"""The Gluon backend for Hopper (sm_90a): a warp-specialised FP8 kernel (TMA producer, two consumer
warpgroups) emitted from the device code in this package with the config's constants injected."""
