

def test_a_backend_without_pinned_host_memory_is_named():
    class Memory:
        kind = "device"

    class Device:
        platform, process_index = "tpu", 0

        def addressable_memories(self):
            return [Memory()]

    class Mesh:
        devices = np.array([Device()])

    check = px.ZeRO(1, "fsdp", offload="optimizer").model_hooks.layout_checks[0]
    with pytest.raises(ValueError, match=r"px\.init: px\.ZeRO\(offload='optimizer'\) keeps state "
                       r"in 'pinned_host' memory, but the mesh's tpu devices have only "
                       r"\['device'\]; drop offload="):
        check([], Mesh(), api="px.init", prefix=(), model=None)
