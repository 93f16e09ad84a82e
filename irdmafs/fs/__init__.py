"""The mount: what paths mean (vfs) and the pyfuse3 adapter (ops)."""
