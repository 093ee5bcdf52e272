"""SchedulerOutput -> the fixed-shape padded step inputs: the batch descriptor, bucket ladders, packing."""
