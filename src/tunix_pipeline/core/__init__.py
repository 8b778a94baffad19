"""What every layer uses, importing nothing of ours above it: user errors, paths and gs:// URIs, processes, the
runtime and its mesh, progress lines, quieting, the full-disk message."""
