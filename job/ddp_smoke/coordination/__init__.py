"""How the ranks of one run work together, outside the backend under test.

Everything between ranks goes through the launcher's TCPStore (:mod:`.keys` names every key,
:mod:`.records` every record), so it works the same for gloo and NCCL and still works when a
collective is stuck.

Threads, one connection, and who ends the process: each rank holds one store connection
(:class:`.store.Connection`: 16,384 ranks are 16,384 sockets on the store's host), shared by
two threads in turns. The **main** thread runs the checks (:mod:`ddp_smoke.harness`) and the
protocol's waits (:mod:`.protocol`), cut in slices; the **liveness** thread (:mod:`.liveness`)
beats and watches deadlines, signals, the abort list and, on rank 0, the heartbeats of the
ranks it waits for; while the main thread holds the connection in a wait, it does the same
between the slices. The run's state is a frozen snapshot only the main thread replaces
(:class:`.protocol.Run`). Once a run is aborted the liveness thread owns the exit
(:func:`.ending.exit_aborted`): nothing ever has to wake the main thread, which may sit inside
a C++ collective. The main thread ends the process only on a clean run, or when it finds the
abort first and the liveness thread has not begun to finish it
(:meth:`.protocol.Coordinator.claim_finish` decides, under a lock, once). While a rank leaves,
one thread keeps its heartbeat going (:meth:`.liveness.Liveness.keep_beating`): a third one
when the liveness thread leaves, since the main thread may never return from C++. In a world
beyond 2,500 ranks a rank other than 0 beats into its node's shared memory, and the node's
lowest running rank posts them all in one record; its arrivals and observations go the same
way, one call a node (:mod:`.node`). Rank 0 says on stderr, as
the run goes, the join, each check as it is judged and whom a long wait waits for
(:mod:`.telling`, from the main thread and from the watchdog's looks).

Diagnosis beyond who stopped: :mod:`.stragglers` finds, from the time each rank spent inside
each collective (:mod:`.progress`), who kept the others waiting; :mod:`.reach` probes, outside
the process group, which node or link cannot be crossed when every rank waits.
"""
