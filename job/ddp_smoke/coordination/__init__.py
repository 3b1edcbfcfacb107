"""How the ranks of one run work together, outside the backend under test.

Everything between ranks goes through the launcher's TCPStore (:mod:`.keys` names every key),
so it works the same for gloo and NCCL and still works when a collective is stuck.

Threads and who ends the process: each rank runs three threads. The **main** thread runs the
checks (:mod:`ddp_smoke.harness`) and the protocol's waits (:mod:`.protocol`); the
**heartbeat** (:mod:`.liveness`) only publishes; the **watchdog** (:mod:`.liveness`) watches
deadlines, signals, the abort list and, on rank 0, the heartbeats of the ranks it waits for.
Once a run is aborted the watchdog owns the exit (:func:`.ending.exit_aborted`): nothing ever
has to wake the main thread, which may sit inside a C++ collective. The main thread ends the
process only on a clean run, or when it finds the abort first and the watchdog has not begun
to finish it (:meth:`.protocol.Coordinator.claim_finish` decides, under a lock, once).

Diagnosis beyond who stopped: :mod:`.stragglers` judges, from the time each rank spent inside
each collective (:mod:`.progress`), who kept the others waiting; :mod:`.reach` probes, outside
the process group, which node or link cannot be crossed when every rank waits.
"""
