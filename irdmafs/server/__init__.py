"""The PS node: stripes in registered regions (store), the namespace (meta), the process (node)."""
