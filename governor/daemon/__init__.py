"""governor.daemon: the service around the loop: engine supervision, control socket, systemd and Termux."""
