"""The host KV tier: blocks spilled from the device pool to (pinned) host memory and loaded back.

``tier`` is the component the device ``KVCacheManager`` holds (``HostTier``); ``blocks`` its
bookkeeping (host blocks, the host prefix cache, one step's copies, the swap cost model);
``memory`` the host buffer the runner allocates; ``copier`` the runner's block moves."""
