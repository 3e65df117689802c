"""The `sluice` command line: `serve`, `worker`, `usage`, `keys`."""
