"""The wire: msgpack codec with limits, protocol v1 messages, ZeroMQ sockets and the client, CURVE keys."""
