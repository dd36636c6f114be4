"""The bus: Redis streams (data plane), MQTT retained versions (control plane), registry, embedded servers.

Submodules import redis and aiomqtt; import them directly (`from tlt_stream.bus.consumer import ...`).
"""
