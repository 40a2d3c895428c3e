package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
)

const (
	stateStarted   = "PrepareStarted"
	stateCompleted = "PrepareCompleted"
)

type deviceRecord struct {
	RequestNames []string `json:"requestNames"`
	Pool         string   `json:"pool"`
	Device       string   `json:"device"`
	CDIDeviceIDs []string `json:"cdiDeviceIDs,omitempty"`
	// ShareID: the allocation's share of a device many claims may hold at once (a shared NIC).
	ShareID string `json:"shareID,omitempty"`
}

type claimRecord struct {
	Namespace string         `json:"namespace"`
	Name      string         `json:"name"`
	State     string         `json:"state"`
	Devices   []deviceRecord `json:"devices"`
}

// checkpoint is Tandem's record of prepared claims, in the same shape: the whole file is
// rewritten atomically on every change (temporary file, rename), under a flock on serialize.lock
// as two instances of a rolling update would need. With fsync (the default) also durably: the
// data and the directory are fsynced, as Tandem did before it found that a record discarded at
// the next boot needs no fsync; -checkpoint-fsync=false makes the same decision as Tandem.
type checkpoint struct {
	mu     sync.Mutex
	path   string
	lock   string
	bootID string
	fsync  bool
	claims map[string]claimRecord
}

func openCheckpoint(dataDir string, fsync bool) (*checkpoint, error) {
	boot, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return nil, err
	}
	c := &checkpoint{
		path:   filepath.Join(dataDir, "checkpoint.json"),
		lock:   filepath.Join(dataDir, "serialize.lock"),
		bootID: strings.TrimSpace(string(boot)),
		fsync:  fsync,
		claims: map[string]claimRecord{},
	}
	return c, c.update(func(map[string]claimRecord) {})
}

func (c *checkpoint) get(uid string) (claimRecord, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	rec, ok := c.claims[uid]
	return rec, ok
}

func (c *checkpoint) put(uid string, rec claimRecord) error {
	return c.update(func(m map[string]claimRecord) { m[uid] = rec })
}

func (c *checkpoint) remove(uid string) error {
	return c.update(func(m map[string]claimRecord) { delete(m, uid) })
}

func (c *checkpoint) update(change func(map[string]claimRecord)) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	lock, err := os.OpenFile(c.lock, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return err
	}
	change(c.claims)
	data, err := json.Marshal(struct {
		Version int                    `json:"version"`
		BootID  string                 `json:"bootID"`
		Claims  map[string]claimRecord `json:"claims"`
	}{1, c.bootID, c.claims})
	if err != nil {
		return err
	}
	return writeAtomically(c.path, data, 0o600, c.fsync)
}

// writeAtomically replaces path so that a crash leaves the old content or the new, never a torn
// file; with fsync, the new content also survives power loss once it returns.
func writeAtomically(path string, data []byte, perm os.FileMode, fsync bool) error {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // fails harmlessly once renamed
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(perm); err != nil {
		tmp.Close()
		return err
	}
	if fsync {
		if err := tmp.Sync(); err != nil {
			tmp.Close()
			return err
		}
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return err
	}
	if !fsync {
		return nil
	}
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
