"""Process plumbing every role uses: spawning and stopping role processes (`procs`),
free ports (`net`), log tails and atomic writes (`files`), the ZeroMQ message
format between the controller and its roles (`wire`), and the run's secret that
authenticates every control message (`auth`).

The lowest layer above types and config: it imports nothing else from fnrl, and the
pure packages (policy, losses) never import it.
"""
