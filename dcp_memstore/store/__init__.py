"""The node-local store: layout on tmpfs, shard files and their mappings, commit protocol, retention."""
