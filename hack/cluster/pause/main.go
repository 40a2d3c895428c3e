// Command pause is the sandbox process of every pod in the local cluster: no registry is
// reachable here, so the cluster cannot pull registry.k8s.io/pause and builds this instead.
//
// A pod sandbox's process only has to hold the pod's namespaces open, end on SIGINT or SIGTERM,
// and, as PID 1 of a pod that shares its process namespace, reap orphaned children.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if os.Getpid() != 1 {
		os.Stderr.WriteString("pause: warning: not running as PID 1\n")
	}
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
