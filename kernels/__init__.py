"""Runtime side: float64 reference, default configs, dispatch, build cache and launcher."""
