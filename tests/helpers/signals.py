"""Events the tests and the agent programs they run share (thread isolation: one process), so that
a program waits for what a test is about, not for a guessed number of seconds."""

import threading

#: set by a test's scripted model once the quick episodes' calls have been generated
QUICK_SERVED = threading.Event()
#: episodes of ``default_client_set_by_every_episode`` that have replaced the process's client
CLIENTS_SET = {"count": 0}
LOCK = threading.Lock()
