"""Implementation; the public names are re-exported by the modules of `cannjax`."""
