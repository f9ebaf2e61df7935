"""governor.lab: simulated devices, workloads, experiments on a virtual clock."""
