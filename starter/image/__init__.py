"""Jobs' images: the node's cache of squashfs images by digest, what goes
into it (squashfs and SIF files, OCI layouts, docker-archives), and the
mount a job's child makes its root (--image)."""
