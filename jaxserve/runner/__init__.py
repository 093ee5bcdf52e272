"""The runner: owns the params and the KV pages, compiles every bucket, runs the steps on the device."""
