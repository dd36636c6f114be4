"""What every layer shares: the configuration tree, the wire schemas, errors, the async helpers, progress
bars, failpoints and stable hashes. Nothing here imports torch, Redis or MQTT."""
