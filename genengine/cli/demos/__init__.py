"""The demos behind ``genengine demo``: ``sync`` (generate, train, sync weights, sleep and wake) and
``asynchronous`` (the same loop through the async calls)."""
