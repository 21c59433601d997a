package agent

// podEvent reports something that happened to a pod (a repair, ...).
// Minimal version: it logs. The Kubernetes Event recorder lands with
// another change (the coordinator keeps that version of this file).
func (a *Agent) podEvent(uid, eventType, reason, message string) {
	e, _ := a.reg.Get(uid)
	a.podLog(e.Namespace, e.Name, uid).Info("pod event", "type", eventType, "reason", reason, "message", message)
}
