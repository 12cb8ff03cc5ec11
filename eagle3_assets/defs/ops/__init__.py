"""Operating the pipeline: sensors that notice stalled, crashed and failed runs and alert on them.
The decisions and the webhook live in `eagle3_assets.alerts`; this package only reads the instance."""
