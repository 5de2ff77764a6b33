"""`vla-node view`: a Foxglove live view of a running node. foxglove-sdk's WebSocket server (loopback) streams the
channels a recording holds (drives/foxglove.py: frames as foxglove images, instruction, state, action, chunk, timing
and health as JSON with JSON schemas), from the same four addresses `vla-node record` listens to, validated the
same way. Open Foxglove, connect to ws://127.0.0.1:PORT, and import the layout file the command writes.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any, Callable, Mapping

from vla_node.drives.foxglove import (
    JSON,
    JSONSCHEMA,
    PROTOBUF,
    encode_image,
    encode_json,
    image_schema,
    json_messages,
    json_schema,
    layout,
)
from vla_node.drives.record import QUEUE_SIZE, DriveSink, listen
from vla_node.validate import ConfigError, require

DEFAULT_PORT = 8765  # foxglove-sdk's and Foxglove's default


class LiveChannels:
    """DriveWriter's add_frame / add_message, onto foxglove-sdk channels (made on first use per topic and schema)."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self._channels: dict[tuple[str, str], Any] = {}

    def _channel(self, topic: str, schema: tuple[str, str, bytes], message_encoding: str) -> Any:
        import foxglove

        channel = self._channels.get((topic, schema[0]))
        if channel is None:
            channel = self._channels[(topic, schema[0])] = foxglove.Channel(
                topic, schema=foxglove.Schema(name=schema[0], encoding=schema[1], data=schema[2]),
                message_encoding=message_encoding, context=self.context)
        return channel

    def add_frame(self, camera: str, seq: int, stamp_ns: int, encoding: str, height: int, width: int,
                  payload: Any) -> None:
        schema_name, data = encode_image(camera, stamp_ns, encoding, height, width, bytes(payload))
        self._channel(f"frame/{camera}", image_schema(schema_name), PROTOBUF).log(data, log_time=stamp_ns)

    def add_message(self, topic: str, stamp_ns: int, header_map: Mapping[str, Any]) -> None:
        for name, message in json_messages(topic, header_map).items():
            schema_name, schema = json_schema(name)
            self._channel(name, (schema_name, JSONSCHEMA, schema), JSON).log(encode_json(message), log_time=stamp_ns)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()


def view(launch: str | Path | None = None, port: int = DEFAULT_PORT, addresses: Mapping[str, str] | None = None,
         duration_s: float | None = None, *, layout_out: str | Path | None = "vla-node.layout.json",
         stop_event: threading.Event | None = None, on_started: Callable[[int], None] | None = None,
         progress: bool = True) -> dict[str, int]:
    """Serve the node's traffic at ws://127.0.0.1:`port` until duration_s, Ctrl-C/SIGTERM or stop_event; writes the
    Foxglove layout to layout_out (None: not). on_started(port) once the server listens (port 0: any free one).
    Returns the messages streamed per kind."""
    import foxglove

    from vla_node.config import default_launch, load_launch

    require(type(port) is int and 0 <= port <= 65535, "port", port, "an integer in [0, 65535] (0 = any free port)")
    config = load_launch(launch if launch is not None else default_launch())
    transport = dataclasses.replace(config.transport, **dict(addresses or {}))
    if transport.curve_keys_dir is not None:
        raise ConfigError("view: transport.curve_keys_dir is set, and viewing encrypted (CURVE) traffic is not "
                          "supported yet; view a launch file without curve_keys_dir")
    if layout_out is not None:
        Path(layout_out).write_text(json.dumps(layout([c.name for c in config.cameras]), indent=1))
    context = foxglove.Context()
    try:
        server = foxglove.start_server(name="vla-node", host="127.0.0.1", port=port, context=context)
    except Exception as e:  # foxglove-sdk raises its own error when the port is taken
        raise OSError(f"view: cannot listen at 127.0.0.1:{port}: {e}") from e
    print(f"Foxglove live view at ws://127.0.0.1:{server.port}"
          + (f" (layout: {layout_out})" if layout_out is not None else ""), flush=True)
    try:
        if on_started is not None:
            on_started(server.port)
        channels = LiveChannels(context)
        sink, _ = listen(config, transport, lambda: DriveSink(None, config.limits, QUEUE_SIZE, writer=channels),
                         f"to ws://127.0.0.1:{server.port}", duration_s, stop_event, progress)
    finally:
        server.stop()
    return dict(sink.written)
