"""Lets the tests' two-process runs find what earlier runs compiled, on both processes.

Imported at start-up by the processes `tests/test_train_multiprocess.py` launches (its `_env`
puts this folder first on PYTHONPATH); nothing else loads it. jax writes its persistent
compilation cache from process 0 only, and on XLA:CPU a key hashes the devices' topology
fingerprint, which differs by process. So process 1 of a run never found a program in the
cache: it compiled the ResNet's initialiser and step (~10 s each under load) while process 0
waited for it in its first collective, in every two-process test. Here:
- a program over devices of several processes is keyed by the global device list instead, so
  both processes compute process 0's key and read what process 0 wrote; the executable is the
  one process 0 compiled for the same global devices, which is what jax's own
  `jax_share_binary_between_hosts` ships between processes;
- a program over this process's devices alone (the initialiser runs on a local device) is also
  written by a process other than 0: its key names its devices, so no other process writes it.
The tests compare weights with a one-process run, so a wrong program could not pass unseen.
With another jax, without these private hooks, everything compiles as before.
"""
import hashlib
import threading

_local = threading.local()


def _install():
    try:
        from jax._src import cache_key, compilation_cache, compiler, config, distributed
    except ImportError:
        return
    if not all(callable(getattr(m, n, None)) for m, n in [(cache_key, "_hash_accelerator_config"),
                                                         (compiler, "_cache_write"),
                                                         (compilation_cache, "put_executable_and_time")]):
        return
    hash_topology, write = cache_key._hash_accelerator_config, compiler._cache_write

    def hash_devices(hash_obj, accelerators):
        import jax

        devices = list(accelerators.flat)
        _local.own = len({d.process_index for d in devices}) == 1 and jax.process_count() > 1
        if _local.own:
            return hash_topology(hash_obj, accelerators)
        world = sorted(jax.devices(), key=lambda d: d.id)
        text = repr(([(d.id, d.process_index, d.platform, d.device_kind) for d in world], [d.id for d in devices]))
        hash_obj.update(hashlib.sha256(text.encode()).digest())

    def write_own(cache_key_, compile_time_secs, module_name, backend, executable, host_callbacks):
        if (distributed.global_state.process_id != 0 and getattr(_local, "own", False) and not host_callbacks
                and compile_time_secs >= config.persistent_cache_min_compile_time_secs.value):
            compilation_cache.put_executable_and_time(cache_key_, module_name, executable, backend,
                                                      int(compile_time_secs))
            return None
        return write(cache_key_, compile_time_secs, module_name, backend, executable, host_callbacks)

    cache_key._hash_accelerator_config = hash_devices
    compiler._cache_write = write_own


_install()
