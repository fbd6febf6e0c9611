"""Role backends: what the loop's handles (fnrl.control.handles) talk to.

`local` is the handles over processes this machine starts (a ZeroMQ trainer, vLLM HTTP
servers, the relay tier), `roles` launches and supervises those processes (`Cluster`,
`LocalLauncher`), `ray_cluster` places the same processes on the nodes of a Ray cluster
(`RayLauncher`), and `memory` plans what every role will hold before any starts. The
simulated roles live with the simulator (fnrl.sim.handles): they are its engine's face
and read its cost models (and, over a trivial one, are the tests' fakes).
"""
