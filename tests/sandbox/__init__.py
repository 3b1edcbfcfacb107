"""Real parts for the tests, each startable by hand too: network-namespace hosts, a Slurm
cluster, a Docker engine. Every module here tears down what it made, by name and by PID."""
