"""The process exit status of a server whose engine died (a failed forward pass): non-zero, so
that a supervisor (systemd, Docker's restart policy, Kubernetes) restarts it. Its own module so
that server.cli and server.graceful both read it without importing each other."""

ENGINE_DIED_EXIT_STATUS = 1
