"""The gateway's other API families, translated onto the chat path (validate.prepare_chat,
structured.py constraints, dispatch, respond.Answer):

    tokenize.py              POST /tokenize, /detokenize (vLLM's shapes)
    responses.py, responses_out.py, store.py   POST /v1/responses (OpenAI Responses API),
                             GET/DELETE /v1/responses/{id}
    messages.py, messages_out.py               POST /v1/messages (Anthropic Messages API)
    common.py                one translated request through dispatch; text -> blocks
    routes.py                add_routes(app, gateway); error bodies in each API's shape
"""
