package ztunnelproto

import (
	"errors"
	"fmt"

	"google.golang.org/protobuf/proto"
)

// ErrProtocol marks a packet that is well-framed but violates the protocol:
// undecodable bytes, an empty oneof, a file descriptor where none belongs.
var ErrProtocol = errors.New("zds protocol violation")

// Op names of requests, as used in logs, metrics and the emulator's state.
const (
	OpAdd          = "add"
	OpDel          = "del"
	OpKeep         = "keep"
	OpSnapshotSent = "snapshot_sent"
)

// HelloV1 returns the hello ztunnel sends first on every connection.
func HelloV1() *ZdsHello { return &ZdsHello{Version: Version_V1} }

// AddRequest builds an AddWorkload request. The netns fd travels beside it.
func AddRequest(uid string, info *WorkloadInfo) *WorkloadRequest {
	return &WorkloadRequest{Payload: &WorkloadRequest_Add{Add: &AddWorkload{Uid: uid, WorkloadInfo: info}}}
}

// KeepRequest builds a KeepWorkload request (snapshot only).
func KeepRequest(uid string) *WorkloadRequest {
	return &WorkloadRequest{Payload: &WorkloadRequest_Keep{Keep: &KeepWorkload{Uid: uid}}}
}

// DelRequest builds a DelWorkload request.
func DelRequest(uid string) *WorkloadRequest {
	return &WorkloadRequest{Payload: &WorkloadRequest_Del{Del: &DelWorkload{Uid: uid}}}
}

// SnapshotSentRequest builds the request that ends the snapshot.
func SnapshotSentRequest() *WorkloadRequest {
	return &WorkloadRequest{Payload: &WorkloadRequest_SnapshotSent{SnapshotSent: &SnapshotSent{}}}
}

// AckResponse builds an ack; an empty errMsg means success.
func AckResponse(errMsg string) *WorkloadResponse {
	return &WorkloadResponse{Payload: &WorkloadResponse_Ack{Ack: &Ack{Error: errMsg}}}
}

// RequestOp names the request's operation, or "" if its oneof is empty.
func RequestOp(r *WorkloadRequest) string {
	switch r.GetPayload().(type) {
	case *WorkloadRequest_Add:
		return OpAdd
	case *WorkloadRequest_Del:
		return OpDel
	case *WorkloadRequest_Keep:
		return OpKeep
	case *WorkloadRequest_SnapshotSent:
		return OpSnapshotSent
	}
	return ""
}

// RequestUID returns the workload uid a request is about ("" for SnapshotSent).
func RequestUID(r *WorkloadRequest) string {
	switch p := r.GetPayload().(type) {
	case *WorkloadRequest_Add:
		return p.Add.GetUid()
	case *WorkloadRequest_Del:
		return p.Del.GetUid()
	case *WorkloadRequest_Keep:
		return p.Keep.GetUid()
	}
	return ""
}

// Marshal encodes m deterministically.
func Marshal(m proto.Message) ([]byte, error) {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return nil, fmt.Errorf("encode %T: %w", m, err)
	}
	return b, nil
}

// DecodeHello decodes ztunnel's first packet.
func DecodeHello(b []byte) (*ZdsHello, error) {
	h := &ZdsHello{}
	if err := proto.Unmarshal(b, h); err != nil {
		return nil, fmt.Errorf("%w: decode hello (% x): %v", ErrProtocol, clip(b), err)
	}
	if h.GetVersion() == Version_NOT_USED {
		return nil, fmt.Errorf("%w: hello without version (% x)", ErrProtocol, clip(b))
	}
	return h, nil
}

// DecodeRequest decodes one agent→ztunnel packet; an empty oneof is an error.
func DecodeRequest(b []byte) (*WorkloadRequest, error) {
	r := &WorkloadRequest{}
	if err := proto.Unmarshal(b, r); err != nil {
		return nil, fmt.Errorf("%w: decode request (% x): %v", ErrProtocol, clip(b), err)
	}
	if RequestOp(r) == "" {
		return nil, fmt.Errorf("%w: request without payload (% x)", ErrProtocol, clip(b))
	}
	return r, nil
}

// DecodeResponse decodes one ztunnel→agent packet and returns its ack.
func DecodeResponse(b []byte) (*Ack, error) {
	r := &WorkloadResponse{}
	if err := proto.Unmarshal(b, r); err != nil {
		return nil, fmt.Errorf("%w: decode response (% x): %v", ErrProtocol, clip(b), err)
	}
	ack := r.GetAck()
	if ack == nil {
		return nil, fmt.Errorf("%w: response without ack (% x)", ErrProtocol, clip(b))
	}
	return ack, nil
}

// clip keeps error messages short when a peer sends a large garbage packet.
func clip(b []byte) []byte {
	if len(b) > 32 {
		return b[:32]
	}
	return b
}
