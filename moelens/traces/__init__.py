"""The pieces of `moelens trace` (moelens.trace): data sources, the manifest, Parquet parts."""
