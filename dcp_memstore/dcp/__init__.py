"""The DCP face: storage writer, storage reader, stager and the msgpack codec for DCP metadata."""
