"""Queue-latency autoscaling: scrape pods (scraper), reduce to a signal (metrics), decide (policy)."""
