"""The status socket: what the daemon answers `tandemctl` with, and the documents it sends."""
