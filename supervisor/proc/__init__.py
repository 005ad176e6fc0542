"""Process control and watching: spawn the child, watch it, stop it, read its health."""
