"""The node's devices as ResourceSlices: building and planning (pure), the live cache, the publisher.

`build` turns devices into slice objects, `plan` turns desired and live slices into the fewest
writes, `cache` keeps the live slices from a list and a watch, and `publisher` runs the thread
that ties them to the inventory and the API server.
"""
