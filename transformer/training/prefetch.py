"""The train batches of the coming steps, made by a background thread while the device runs the step."""

import concurrent.futures


class Prefetch:
    """The train batches of the coming steps, made by a background thread (numpy work: reads of
    memory-mapped stores, masking, augmentation) and placed on the devices (`place`) while the
    device runs the step; a batch depends on its step alone, so nothing of it needs saving. With `ahead`=0
    (an on-policy task, whose batch the step's params make) a step's batch is begun only when asked for."""

    def __init__(self, make, end: int, ahead: int = 2):
        self.make, self.end, self.ahead = make, end, ahead
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batches")
        self.pending: dict[int, concurrent.futures.Future] = {}

    def get(self, step: int) -> dict:
        for s in range(step, min(step + self.ahead + 1, self.end)):
            if s not in self.pending:
                self.pending[s] = self.pool.submit(self.make, s)
        return self.pending.pop(step).result()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
