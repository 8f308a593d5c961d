"""The inbound rim: the ASGI application and the hypercorn server around it."""
