"""The operator's top floor: the process. Its entry and command line, the kopf handlers that hand each job to its
loop, leader election, the admission webhook and the process-wide settings (watch decoding, heap trimming).
"""
