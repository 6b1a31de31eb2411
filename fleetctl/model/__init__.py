"""The performance model: GPU, model and format profiles, memory and speed from physics, the
measurements that calibrate them, and one server's estimate."""
