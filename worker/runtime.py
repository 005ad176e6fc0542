# TEMPORARY shim until the process layer lands (not committed)
def install(): pass
def should_stop(): return False
def request_stop(): pass
def heartbeat(**kw): pass
